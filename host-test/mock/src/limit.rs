//! An account limit the mock enforces when a test sets one, as HolySheep does: a bucket of
//! requests refilled at `per_minute`, holding at most `burst`. A chat call that finds it
//! empty is a 429 `rate_limit_exceeded` with `retry-after-ms`; every chat answer then
//! announces the limit, what is left and when the bucket is whole again in OpenAI's
//! `x-ratelimit-*-requests`.

use std::time::Instant;

#[derive(Debug)]
pub(crate) struct RequestLimit {
    per_minute: f64,
    burst: f64,
    left: f64,
    at: Instant,
    /// When each call arrived, and whether the limit turned it away.
    pub(crate) calls: Vec<(Instant, bool)>,
}

impl RequestLimit {
    pub(crate) fn new(per_minute: u32, burst: u32) -> RequestLimit {
        let burst = f64::from(burst.max(1));
        RequestLimit {
            per_minute: f64::from(per_minute.max(1)),
            burst,
            left: burst,
            at: Instant::now(),
            calls: Vec::new(),
        }
    }

    fn per_ms(&self) -> f64 {
        self.per_minute / 60_000.0
    }

    fn refill(&mut self, now: Instant) {
        let ms = now.saturating_duration_since(self.at).as_secs_f64() * 1000.0;
        self.left = (self.left + ms * self.per_ms()).min(self.burst);
        self.at = now;
    }

    /// A call arrives: `Err(ms)` when the bucket has no request for it, `ms` until it has.
    pub(crate) fn take(&mut self) -> Result<(), u64> {
        let now = Instant::now();
        self.refill(now);
        let turned_away = self.left < 1.0;
        self.calls.push((now, turned_away));
        if turned_away {
            return Err(((1.0 - self.left) / self.per_ms()).ceil() as u64);
        }
        self.left -= 1.0;
        Ok(())
    }

    /// `x-ratelimit-*-requests` as they stand.
    pub(crate) fn headers(&self) -> [(&'static str, String); 3] {
        let full_in = ((self.burst - self.left).max(0.0) / self.per_ms()).ceil() as u64;
        [
            ("x-ratelimit-limit-requests", format!("{}", self.per_minute as u64)),
            ("x-ratelimit-remaining-requests", format!("{}", self.left.max(0.0).floor() as u64)),
            ("x-ratelimit-reset-requests", format!("{full_in}ms")),
        ]
    }
}
