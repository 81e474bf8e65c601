//! Notices Envoy's missing `allow_on_headers_stop_iteration: true`. Without it Envoy never
//! delivers the body to a filter that paused on request headers, and every chat request
//! would hang. A VM that has never received a request body and holds a request paused on
//! its headers for `STALL_MS` answers it with a 500 naming the setting (and logs it once).
//! The first body that arrives proves the setting is on and disarms the watch for good.

use super::ids::IdMap;

/// How long a request may wait for its first body bytes before the watch gives up.
pub const STALL_MS: u64 = 1_000;

pub const MESSAGE: &str = "the edge is misconfigured: the Envoy wasm filter needs \
    `allow_on_headers_stop_iteration: true` (without it the request body never reaches the filter)";

#[derive(Default)]
pub struct BodyWatch {
    armed_off: bool,
    paused: IdMap<u64>,
    reported: bool,
}

impl BodyWatch {
    /// Request `id` paused on its headers at `now_ms()`, waiting for its body (the clock is
    /// read only while the watch is armed: a host call saved on every later request).
    pub fn paused(&mut self, id: u32, now_ms: impl FnOnce() -> u64) {
        if !self.armed_off {
            self.paused.insert(id, now_ms());
        }
    }

    /// A request body arrived: the setting is on.
    pub fn body_arrived(&mut self) {
        if !self.armed_off {
            self.armed_off = true;
            self.paused = IdMap::default();
        }
    }

    pub fn forget(&mut self, id: u32) {
        self.paused.remove(&id);
    }

    /// The requests that waited too long for a body (no longer watched), and whether this
    /// is the first time the watch reports any.
    pub fn stalled(&mut self, now_ms: u64) -> (Vec<u32>, bool) {
        let ids: Vec<u32> = self
            .paused
            .iter()
            .filter(|(_, since)| now_ms.saturating_sub(**since) >= STALL_MS)
            .map(|(id, _)| *id)
            .collect();
        for id in &ids {
            self.paused.remove(id);
        }
        let first = !ids.is_empty() && !self.reported;
        self.reported |= first;
        (ids, first)
    }
}
