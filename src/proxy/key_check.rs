//! The API-key check: once per Envoy process (the first worker VM to claim a shared-data
//! flag; never the canary VM), `GET /v1/models` with the configured key. The key is never
//! logged.

use super::abi as hostcalls;
use super::host::{self, SharedData};
use super::root::Root;
use super::worker::Worker;
use crate::core::store::claim;
use proxy_wasm::types::{LogLevel, MapType};
use std::time::Duration;

/// Shared-data key claimed by the one VM per Envoy process that checks the API key.
const KEY_CHECK: &str = "holysheep/key-check";

/// How often a worker logs that HolySheep refuses the configured key.
const KEY_REFUSED_LOG_MS: u64 = 10_000;

/// HolySheep refused the configured key on a chat call: the client got the edge's own 502,
/// and the log names where the key comes from (never the key), at most every
/// `KEY_REFUSED_LOG_MS` per worker (clients must not be able to flood it).
pub(super) fn report_key_refused(worker: &mut Worker, status: u16) {
    let now = host::now_ms();
    if now.saturating_sub(worker.key_refused_logged_ms) < KEY_REFUSED_LOG_MS {
        return;
    }
    worker.key_refused_logged_ms = now;
    let env = &worker.config.upstream.api_key_env;
    host::log(LogLevel::Error, &format!("holysheep: HolySheep refused the key from ${env} (status {status})"));
}

impl Root {
    /// Once per Envoy process (the first worker to claim it), ask HolySheep whether the
    /// configured key is accepted. The key is never logged.
    pub(super) fn check_key(&mut self) {
        let (config, bearer) = {
            let mut w = self.worker.borrow_mut();
            if w.key_checked {
                return;
            }
            w.key_checked = true;
            (w.config.clone(), w.bearer.clone())
        };
        let Some(bearer) = bearer else { return };
        if !claim(&SharedData, KEY_CHECK, b"1") {
            return;
        }
        let headers = vec![
            (":method", "GET"),
            (":path", "/v1/models"),
            (":authority", config.upstream.authority.as_str()),
            ("authorization", bearer.as_str()),
        ];
        let timeout = Duration::from_millis(config.upstream.timeout_ms);
        if let Ok(token) = hostcalls::dispatch_http_call(&config.upstream.cluster, headers, None, vec![], timeout) {
            self.worker.borrow_mut().key_check_token = Some(token);
        }
    }

    pub(super) fn report_key_check(&self, num_headers: usize) {
        let env = self.worker.borrow().config.upstream.api_key_env.clone();
        let status = if num_headers == 0 { None } else { self.response_header(":status") };
        match status.as_deref() {
            Some("200") => host::log(LogLevel::Info, &format!("holysheep: HolySheep accepted the key from ${env}")),
            Some(s @ ("401" | "403")) => host::log(
                LogLevel::Error,
                &format!("holysheep: HolySheep REJECTED the key from ${env} (status {s}): every call will fail"),
            ),
            other => host::log(
                LogLevel::Warn,
                &format!("holysheep: could not check the key from ${env} (status {})", other.unwrap_or("none")),
            ),
        }
    }

    pub(super) fn response_header(&self, name: &str) -> Option<String> {
        host::header(MapType::HttpCallResponseHeaders, name)
    }
}
