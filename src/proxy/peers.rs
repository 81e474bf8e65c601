//! Fleet-wide limits, the key owner's side: asking a model's owner node to admit a call
//! and telling it how the call ended, by callouts to the fleet's consistently hashed
//! cluster (Envoy hashes a callout on its `:authority`, which names the bucket).

use super::abi as hostcalls;
use super::host;
use super::root::Root;
use crate::core::peer::{Op, Verdict, SECRET_HEADER};
use crate::core::request::PEER_PATH;
use proxy_wasm::types::{BufferType, LogLevel, MapType};
use std::time::Duration;

/// How long a settlement may take; nobody waits for it.
const SETTLE_TIMEOUT_MS: u64 = 5_000;

impl Root {
    /// Sends `op` to the owner of `bucket`; `None` when it cannot be sent (no secret, no
    /// cluster): the flight then admits from this node's share.
    pub(super) fn ask(&mut self, bucket: &str, op: &Op, timeout_ms: u64) -> Option<u32> {
        let (cluster, secret) = {
            let w = self.worker.borrow();
            (w.config.fleet.cluster.clone(), w.peer_secret.clone()?)
        };
        let authority = Op::authority(bucket);
        let headers = vec![
            (":method", "POST"),
            (":path", PEER_PATH),
            (":authority", authority.as_str()),
            ("content-type", "application/json"),
            (SECRET_HEADER, secret.as_str()),
        ];
        let timeout = Duration::from_millis(timeout_ms.max(1));
        match hostcalls::dispatch_http_call(&cluster, headers, Some(&op.to_json()), vec![], timeout) {
            Ok(token) => Some(token),
            Err(status) => {
                self.fleet_reached(false, &format!("callout to fleet cluster '{cluster}' refused: {status:?}"));
                None
            }
        }
    }

    /// Sends the settlements the flights left for model owners, without waiting for them.
    pub(super) fn send_settlements(&mut self) {
        let ops = std::mem::take(&mut self.worker.borrow_mut().outbox);
        for op in ops {
            let bucket = self.worker.borrow().config.model(op.model()).map(|(b, _)| b.to_owned());
            if let Some(bucket) = bucket {
                self.ask(&bucket, &op, SETTLE_TIMEOUT_MS);
            }
        }
    }

    /// Logs when model owners stop answering (once, not per request: `fleet_local_share`
    /// counts those) and when they answer again.
    fn fleet_reached(&mut self, reached: bool, why: &str) {
        let mut w = self.worker.borrow_mut();
        if reached == w.fleet_reached {
            return;
        }
        w.fleet_reached = reached;
        if reached {
            host::log(LogLevel::Info, "holysheep: model owners answer again: fleet-wide limits");
        } else {
            host::log(LogLevel::Warn, &format!("holysheep: {why}: admitting this node's share of the limits"));
        }
    }

    /// A model owner answered (or failed to): the flight that asked goes on. `false` when
    /// `token` was not an admission.
    pub(super) fn on_verdict(&mut self, token: u32, num_headers: usize, body_size: usize) -> bool {
        let Some(mut run) = self.worker.borrow_mut().asking.remove(&token) else { return false };
        let status = host::header(MapType::HttpCallResponseHeaders, ":status");
        let verdict = (num_headers > 0 && status.as_deref() == Some("200"))
            .then(|| Verdict::parse(&host::buffer(BufferType::HttpCallResponseBody, body_size)))
            .flatten();
        let status = status.unwrap_or_else(|| "none".into());
        self.fleet_reached(verdict.is_some(), &format!("a model owner did not answer (status {status})"));
        run.flight.on_verdict(verdict);
        let action = self.resume(&mut run);
        self.advance(run, action);
        true
    }
}
