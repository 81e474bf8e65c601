//! The API-key check: once per Envoy process (the first worker VM to claim a shared-data
//! flag; never the canary VM), `GET /v1/models` with the configured key; and the log line
//! when HolySheep refuses the key on a chat call. The key is never logged.

use super::abi as hostcalls;
use super::host::{self, SharedData};
use crate::core::api::headers;
use crate::core::config::Config;
use crate::core::store::claim;
use crate::proxy::types::LogLevel;
use std::time::Duration;

/// Shared-data key claimed by the one VM per Envoy process that checks the API key.
const KEY_CHECK: &str = "holysheep/key-check";

/// How often a worker logs that HolySheep refuses the configured key.
const KEY_REFUSED_LOG_MS: u64 = 10_000;

#[derive(Default)]
pub struct KeyCheck {
    started: bool,
    /// When this worker last logged that HolySheep refuses the configured key.
    refused_logged_ms: u64,
}

impl KeyCheck {
    /// Whether this worker should try the check now: once per VM.
    pub fn due(&mut self) -> bool {
        !std::mem::replace(&mut self.started, true)
    }

    /// The check's callout was answered: logs its verdict.
    pub fn answered(&self, config: &Config, num_headers: usize) {
        let env = &config.upstream.api_key_env;
        match host::callout_status(num_headers) {
            Some(200) => host::log(LogLevel::Info, &format!("holysheep: HolySheep accepted the key from ${env}")),
            Some(s @ (401 | 403)) => host::log(
                LogLevel::Error,
                &format!("holysheep: HolySheep REJECTED the key from ${env} (status {s}): every call will fail"),
            ),
            other => host::log(
                LogLevel::Warn,
                &format!(
                    "holysheep: could not check the key from ${env} (status {})",
                    other.map_or("none".to_owned(), |s| s.to_string())
                ),
            ),
        }
    }

    /// HolySheep refused the configured key on a chat call: the client got the edge's own
    /// 502, and the log names where the key comes from (never the key), at most every
    /// `KEY_REFUSED_LOG_MS` per worker (clients must not be able to flood it).
    pub fn refused(&mut self, config: &Config, status: u16) {
        let now = host::now_ms();
        if now.saturating_sub(self.refused_logged_ms) < KEY_REFUSED_LOG_MS {
            return;
        }
        self.refused_logged_ms = now;
        let env = &config.upstream.api_key_env;
        host::log(LogLevel::Error, &format!("holysheep: HolySheep refused the key from ${env} (status {status})"));
    }
}

/// Once per Envoy process (the first worker to claim it), asks HolySheep whether the
/// configured key (`bearer`) is accepted; the callout's token.
pub fn send(config: &Config, bearer: &str) -> Option<u32> {
    if !claim(&SharedData, KEY_CHECK, b"1") {
        return None;
    }
    let headers = vec![
        (":method", "GET"),
        (":path", "/v1/models"),
        (":authority", config.upstream.authority.as_str()),
        (headers::AUTHORIZATION, bearer),
    ];
    let timeout = Duration::from_millis(config.upstream.timeout_ms);
    hostcalls::dispatch_http_call(&config.upstream.cluster, headers, None, timeout).ok()
}
