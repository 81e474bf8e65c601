//! Notices Envoy's missing `allow_on_headers_stop_iteration: true`. Without it Envoy never
//! delivers the body to a filter that paused on request headers, and every chat request
//! would hang. A VM that has never received a request body and holds a request paused on
//! its headers for `STALL_MS` looks for evidence: Envoy has received bytes of that
//! request's body (its `request.total_size` grew) that never reached the filter. Only then
//! is the request answered with a 500 naming the setting (logged once); a slow client whose
//! body has not arrived waits on. The first body that arrives proves the setting is on and
//! disarms the watch for good.

use super::ids::IdMap;

/// How long a request may wait for its first body bytes before the watch looks for evidence.
pub const STALL_MS: u64 = 1_000;

pub const MESSAGE: &str = "the edge is misconfigured: the Envoy wasm filter needs \
    `allow_on_headers_stop_iteration: true` (without it the request body never reaches the filter)";

#[derive(Default)]
pub struct BodyWatch {
    armed_off: bool,
    /// Paused requests: since when, and the bytes Envoy had received of each then.
    paused: IdMap<(u64, u64)>,
    reported: bool,
}

impl BodyWatch {
    /// Request `id` paused on its headers at `now_ms()`, waiting for its body, when Envoy had
    /// received `received()` bytes of it (both read only while the watch is armed: host
    /// calls saved on every later request).
    pub fn paused(&mut self, id: u32, now_ms: impl FnOnce() -> u64, received: impl FnOnce() -> u64) {
        if !self.armed_off {
            self.paused.insert(id, (now_ms(), received()));
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

    /// The requests that waited `STALL_MS` for a body Envoy has received part of since they
    /// paused (`received(id)`: the bytes now; `None` when it cannot tell): no longer
    /// watched. And whether this is the first time the watch reports any.
    pub fn stalled(&mut self, now_ms: u64, mut received: impl FnMut(u32) -> Option<u64>) -> (Vec<u32>, bool) {
        if self.armed_off {
            return (Vec::new(), false);
        }
        let ids: Vec<u32> = self
            .paused
            .iter()
            .filter(|(_, (since, _))| now_ms.saturating_sub(*since) >= STALL_MS)
            .filter(|(id, (_, before))| received(**id).is_some_and(|now| now > *before))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_body_envoy_received_and_never_delivered_is_evidence() {
        let mut w = BodyWatch::default();
        w.paused(1, || 0, || 300);
        w.paused(2, || 0, || 300);
        let received = |id: u32| Some(if id == 1 { 300 + 42 } else { 300 });
        assert_eq!(w.stalled(STALL_MS - 1, received), (vec![], false), "not before STALL_MS");
        assert_eq!(w.stalled(STALL_MS, received), (vec![1], true), "2 is only a slow client");
        assert_eq!(w.stalled(10 * STALL_MS, received), (vec![], false), "2 waits on");
        w.paused(3, || 0, || 10);
        assert_eq!(w.stalled(STALL_MS, |_| Some(11)), (vec![3], false), "reported once");
        w.paused(4, || 0, || 10);
        w.body_arrived();
        assert_eq!(w.stalled(STALL_MS, |_| Some(11)), (vec![], false), "disarmed by a body");
    }
}
