//! Fleet-wide limits, the key owner's side: asking a model's owner node to admit a call
//! and telling it how the call ended, by callouts to the fleet's consistently hashed
//! cluster (Envoy hashes a callout on its `:authority`, which names the bucket).

use super::abi as hostcalls;
use super::host;
use crate::core::api::headers;
use crate::core::config::Config;
use crate::core::intake::Peer;
use crate::core::limits::fleet::{Op, Verdict};
use crate::core::request::PEER_PATH;
use crate::proxy::types::{BufferType, LogLevel, Status};
use std::time::Duration;

/// How long a settlement may take; nobody waits for it.
pub const SETTLE_TIMEOUT_MS: u64 = 5_000;

pub struct Fleet {
    /// The fleet's shared secret (from the environment), and a second one accepted during
    /// a rotation; never logged.
    pub secret: Option<String>,
    pub accepted: Option<String>,
    /// Settlements for model owner nodes, sent from the root context.
    pub outbox: Vec<Op>,
    /// Whether the last model owner asked answered (for logging the changes only).
    reached: bool,
}

impl Fleet {
    /// A request's sender as this node knows it: `sans` of its verified client
    /// certificate, and the fleet's secrets.
    pub fn peer(&self, sans: Vec<String>) -> Peer<'_> {
        Peer { sans, secrets: [self.secret.as_deref(), self.accepted.as_deref()] }
    }
}

impl Default for Fleet {
    fn default() -> Self {
        Fleet { secret: None, accepted: None, outbox: Vec::new(), reached: true }
    }
}

/// Sends `op` to the owner of `bucket` with the fleet's `secret` (Envoy hashes the callout
/// on its `:authority`, which names the bucket); the callout's token.
pub fn ask(config: &Config, secret: &str, bucket: &str, op: &Op, timeout_ms: u64) -> Result<u32, Status> {
    let authority = Op::authority(bucket);
    let headers = vec![
        (":method", "POST"),
        (":path", PEER_PATH),
        (":authority", authority.as_str()),
        (headers::CONTENT_TYPE, "application/json"),
        (headers::PEER_SECRET, secret),
    ];
    let timeout = Duration::from_millis(timeout_ms.max(1));
    hostcalls::dispatch_http_call(&config.fleet.cluster, headers, Some(&op.to_json()), timeout)
}

impl Fleet {
    /// The verdict a model owner's answer carries (`None`: it failed), logged when owners
    /// stop or start answering (a tenant's owner is not: a node of the previous release
    /// refuses tenants' calls, and its model answers must not flap the log).
    pub fn verdict(&mut self, num_headers: usize, body_size: usize, for_tenant: bool) -> Option<Verdict> {
        let status = host::callout_status(num_headers);
        let verdict = (status == Some(200))
            .then(|| Verdict::parse(&host::buffer(BufferType::HttpCallResponseBody, body_size)))
            .flatten();
        let status = status.map_or("none".to_owned(), |s| s.to_string());
        if !for_tenant {
            self.reached(verdict.is_some(), &format!("a model owner did not answer (status {status})"));
        }
        verdict
    }

    /// Logs when model owners stop answering (once, not per request: `fleet_local_share`
    /// counts those) and when they answer again.
    pub fn reached(&mut self, reached: bool, why: &str) {
        if std::mem::replace(&mut self.reached, reached) == reached {
            return;
        }
        if reached {
            host::log(LogLevel::Info, "holysheep: model owners answer again: fleet-wide limits");
        } else {
            host::log(LogLevel::Warn, &format!("holysheep: {why}: admitting this node's share of the limits"));
        }
    }
}
