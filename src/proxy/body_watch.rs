//! Notices Envoy's missing `allow_on_headers_stop_iteration: true`. Without it Envoy never
//! delivers the body to a filter that paused on request headers, and every chat request
//! would hang. A VM that has never received a request body and holds a request paused on
//! its headers for `STALL_MS` looks for evidence that Envoy has body bytes the filter never
//! got: the request's `request.total_size` grew since it paused, or already holds its whole
//! declared body (a filter before this one held the headers while the body came). Only
//! then is the request answered with a 500 naming the setting (logged once); a slow client
//! whose body has not arrived waits on. The first body that arrives proves the setting is on and
//! disarms the watch for good.

use super::ids::IdMap;

/// How long a request may wait for its first body bytes before the watch looks for evidence.
pub const STALL_MS: u64 = 1_000;

pub const MESSAGE: &str = "the edge is misconfigured: the Envoy wasm filter needs \
    `allow_on_headers_stop_iteration: true` (without it the request body never reaches the filter)";

#[derive(Default)]
pub struct BodyWatch {
    armed_off: bool,
    paused: IdMap<Paused>,
    reported: bool,
}

/// A request paused on its headers, as the watch knows it.
#[derive(Debug, Clone, Copy)]
pub struct Paused {
    pub since_ms: u64,
    /// Envoy's `request.total_size` then (`None`: it could not tell).
    pub received: Option<u64>,
    /// Bytes of the request's headers (names and values), and its declared body length.
    pub header_bytes: u64,
    pub declared: Option<u64>,
}

impl Paused {
    /// Whether `total` (Envoy's `request.total_size` now) shows body bytes the filter
    /// never got.
    fn body_withheld(&self, total: u64) -> bool {
        let grown = self.received.is_some_and(|before| total > before);
        let whole = self.declared.is_some_and(|n| n > 0 && total.saturating_sub(self.header_bytes) >= n);
        grown || whole
    }
}

impl BodyWatch {
    /// Request `id` paused on its headers, waiting for its body; `paused()` is asked only
    /// while the watch is armed (host calls saved on every later request).
    pub fn paused(&mut self, id: u32, paused: impl FnOnce() -> Paused) {
        if !self.armed_off {
            self.paused.insert(id, paused());
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

    /// The requests that waited `STALL_MS` while Envoy withheld body bytes from the filter
    /// (`received(id)`: its `request.total_size` now; `None` when it cannot tell): no
    /// longer watched. And whether this is the first time the watch reports any.
    pub fn stalled(&mut self, now_ms: u64, mut received: impl FnMut(u32) -> Option<u64>) -> (Vec<u32>, bool) {
        if self.armed_off {
            return (Vec::new(), false);
        }
        let ids: Vec<u32> = self
            .paused
            .iter()
            .filter(|(_, p)| now_ms.saturating_sub(p.since_ms) >= STALL_MS)
            .filter(|(id, p)| received(**id).is_some_and(|total| p.body_withheld(total)))
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

    fn paused(received: Option<u64>, declared: Option<u64>) -> impl FnOnce() -> Paused {
        move || Paused { since_ms: 0, received, header_bytes: 100, declared }
    }

    #[test]
    fn only_a_body_envoy_received_and_never_delivered_is_evidence() {
        let mut w = BodyWatch::default();
        w.paused(1, paused(Some(300), Some(42)));
        w.paused(2, paused(Some(300), Some(42)));
        let received = |id: u32| Some(if id == 1 { 300 + 42 } else { 300 });
        assert_eq!(w.stalled(STALL_MS - 1, received), (vec![], false), "not before STALL_MS");
        assert_eq!(w.stalled(STALL_MS, received), (vec![1], true), "2 is only a slow client");
        assert_eq!(w.stalled(10 * STALL_MS, received), (vec![], false), "2 waits on");
        // The whole body already at Envoy when the request paused (an earlier filter held
        // its headers): 100 bytes of headers and 42 of body.
        w.paused(3, paused(Some(142), Some(42)));
        assert_eq!(w.stalled(STALL_MS, |_| Some(142)), (vec![3], false), "reported once");
        // A total that cannot be read at first is no growth.
        w.paused(4, paused(None, Some(42)));
        assert_eq!(w.stalled(STALL_MS, |_| Some(120)), (vec![], false));
        w.paused(5, paused(Some(100), None));
        w.body_arrived();
        assert_eq!(w.stalled(STALL_MS, |_| Some(999)), (vec![], false), "disarmed by a body");
    }
}
