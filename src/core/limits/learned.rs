//! What HolySheep's `x-ratelimit-*` headers teach a model's bucket: its own limits per
//! minute, each kept for as long as its answers keep announcing it, never above the
//! configured limits; and what was charged with each call in flight, and when, so that the
//! remainder an answer reports (as it stood when the call arrived) is taken less the calls
//! sent after that one, and plus what refilled since.

use super::Limits;
use crate::core::api::hints::ProviderHints;

/// How long a limit HolySheep announced is kept after its last announcement. (Its
/// `x-ratelimit-reset-*` says when its remainder is whole again, not how long the limit
/// stands: a long reset keeps no limit longer.)
pub(crate) const LEARN_MS: u64 = 60_000;
/// The calls in flight a bucket remembers the charges of; a call beyond them is taken to
/// have had nothing charged after it.
pub(crate) const MAX_SENT: usize = 256;

/// A bucket's learning.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Learned {
    /// HolySheep's requests a minute, and when that lapses.
    pub requests: Option<(f64, u64)>,
    /// HolySheep's tokens a minute, and when that lapses.
    pub tokens: Option<(f64, u64)>,
    /// Requests and tokens charged so far.
    pub charged: (u64, f64),
    /// The calls in flight, each with what had been charged with it.
    pub sent: Vec<Sent>,
}

/// A call in flight: its id, the requests and tokens charged up to and with it, when it
/// was charged, and when it is forgotten (its worker died).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sent {
    pub id: u64,
    pub requests: u64,
    pub tokens: f64,
    pub at: u64,
    pub expires: u64,
}

impl Learned {
    /// `l` lowered to the limits learned that stand at `now_ms`: a request rate (and the
    /// burst with it) and a token rate, each only ever lowered.
    pub fn lower(&self, l: &Limits, now_ms: u64) -> Limits {
        let mut out = *l;
        if let (Some(rpm), Some((learned, until))) = (l.rpm, self.requests) {
            if now_ms < until && learned < rpm {
                out.rpm = Some(learned);
                out.burst = out.burst.min(learned.max(1.0));
            }
        }
        if let (Some(tpm), Some((learned, until))) = (l.tpm, self.tokens) {
            if now_ms < until && learned < tpm {
                out.tpm = Some(learned);
            }
        }
        out
    }

    /// The call `id` was charged `tokens` (and a request) at `at`, held until `expires`.
    pub fn charge(&mut self, id: u64, tokens: f64, at: u64, expires: u64) {
        self.charged = (self.charged.0.wrapping_add(1), self.charged.1 + tokens);
        if self.sent.len() < MAX_SENT {
            let (requests, tokens) = self.charged;
            self.sent.push(Sent { id, requests, tokens, at, expires });
        }
    }

    /// `n` more requests sent for calls already charged (a stream's attempts beyond its
    /// first): they count as sent after every call in flight.
    pub fn more_requests(&mut self, n: u64) {
        self.charged.0 = self.charged.0.wrapping_add(n);
    }

    /// What the call `id`'s answer found left, brought to `now_ms` for a bucket limited as
    /// `l`: less the requests and tokens charged after the call (HolySheep had not counted
    /// them), plus what refilled since the call was charged (at `l`'s rates, which are
    /// never above HolySheep's own when it announced them), within the bucket's capacity.
    /// `None` for a call not remembered.
    pub fn left(
        &self,
        id: u64,
        l: &Limits,
        left: (Option<f64>, Option<f64>),
        now_ms: u64,
    ) -> (Option<f64>, Option<f64>) {
        let Some(s) = self.sent.iter().find(|s| s.id == id) else { return (None, None) };
        let since = now_ms.saturating_sub(s.at) as f64;
        let requests = left.0.map(|r| {
            let after = self.charged.0.wrapping_sub(s.requests) as f64;
            (r - after + since * l.req_per_ms()).min(l.burst)
        });
        let tokens = left.1.map(|t| {
            let after = (self.charged.1 - s.tokens).max(0.0);
            (t - after + since * l.tok_per_ms()).min(l.tpm.unwrap_or(f64::INFINITY))
        });
        (requests, tokens)
    }

    /// The call `id` ended.
    pub fn forget(&mut self, id: u64) {
        self.sent.retain(|s| s.id != id);
    }

    /// Forgets the calls whose workers died, and the limits no answer announced again.
    pub fn lapse(&mut self, now_ms: u64) {
        self.sent.retain(|s| s.expires > now_ms);
        self.requests = self.requests.filter(|(_, until)| *until > now_ms);
        self.tokens = self.tokens.filter(|(_, until)| *until > now_ms);
    }

    /// Learns the limits an answer announced, for a bucket configured with `l`: only a
    /// limit below the configured one is kept (a header never raises a limit), for
    /// `LEARN_MS`.
    pub fn learn(&mut self, l: &Limits, hints: &ProviderHints, now_ms: u64) {
        let until = now_ms.saturating_add(LEARN_MS);
        // A node's share of a fleet's limits learns its share of the account's.
        let among = f64::from(l.among.max(1));
        if let (Some(limit), Some(rpm)) = (hints.limit_requests.map(|r| r / among), l.rpm) {
            self.requests = (limit < rpm).then_some((limit, until));
        }
        if let (Some(limit), Some(tpm)) = (hints.limit_tokens.map(|t| t / among), l.tpm) {
            self.tokens = (limit < tpm).then_some((limit, until));
        }
    }

    /// Its lines in a bucket's record.
    pub fn encode(&self, out: &mut String) {
        use std::fmt::Write;
        if self.charged != (0, 0.0) {
            let _ = writeln!(out, "c {} {:x}", self.charged.0, self.charged.1.to_bits());
        }
        for s in &self.sent {
            let _ = writeln!(out, "s {} {} {:x} {} {}", s.id, s.requests, s.tokens.to_bits(), s.at, s.expires);
        }
        for (tag, learned) in [("r", self.requests), ("t", self.tokens)] {
            if let Some((limit, until)) = learned {
                let _ = writeln!(out, "{tag} {:x} {until}", limit.to_bits());
            }
        }
    }

    /// Reads one line of a bucket's record (`parts`, split at spaces) that is its own.
    pub fn decode_line<'a>(&mut self, mut parts: impl Iterator<Item = &'a [u8]>) {
        let number = |p: Option<&[u8]>| p.and_then(crate::core::wire::codec::number);
        let float = |p: Option<&[u8]>| {
            p.and_then(crate::core::wire::codec::hex_number).map(f64::from_bits).filter(|f| f.is_finite())
        };
        match parts.next() {
            Some(b"c") => {
                if let (Some(n), Some(t)) = (number(parts.next()), float(parts.next())) {
                    self.charged = (n, t);
                }
            }
            Some(b"s") => {
                let (id, requests, tokens) = (number(parts.next()), number(parts.next()), float(parts.next()));
                let (at, expires) = (number(parts.next()), number(parts.next()));
                if let (Some(id), Some(requests), Some(tokens), Some(at), Some(expires)) =
                    (id, requests, tokens, at, expires)
                {
                    if self.sent.len() < MAX_SENT {
                        self.sent.push(Sent { id, requests, tokens, at, expires });
                    }
                }
            }
            Some(tag @ (b"r" | b"t")) => {
                if let (Some(limit), Some(until)) = (float(parts.next()), number(parts.next())) {
                    let learned = Some((limit, until)).filter(|(l, _)| *l >= 1.0);
                    if tag == b"r" {
                        self.requests = learned;
                    } else {
                        self.tokens = learned;
                    }
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            rpm: Some(600.0),
            tpm: Some(100_000.0),
            burst: 600.0,
            max_in_flight: None,
            reserve: 0.0,
            max_line: 100,
            shared: true,
            among: 1,
        }
    }

    fn announced(requests: f64, tokens: f64, reset_ms: u64) -> ProviderHints {
        ProviderHints {
            limit_requests: Some(requests),
            limit_tokens: Some(tokens),
            reset_requests_ms: Some(reset_ms),
            reset_tokens_ms: Some(reset_ms),
            ..ProviderHints::default()
        }
    }

    #[test]
    fn a_lower_limit_is_kept_a_minute_after_its_last_announcement_and_a_higher_one_never() {
        let (l, mut learned) = (limits(), Learned::default());
        learned.learn(&l, &announced(120.0, 40_000.0, 500), 1_000);
        let lowered = learned.lower(&l, 1_000);
        assert_eq!((lowered.rpm, lowered.burst, lowered.tpm), (Some(120.0), 120.0, Some(40_000.0)));
        assert_eq!(learned.lower(&l, 1_000 + LEARN_MS).rpm, Some(600.0), "lapsed");
        // A reset a day off keeps no limit longer: one answer cannot hold a model a day.
        learned.learn(&l, &announced(1.0, 40_000.0, 86_400_000), 1_000);
        assert_eq!(learned.lower(&l, 1_000 + LEARN_MS).rpm, Some(600.0));
        // A limit at or above the configured one is not learned, and forgets a lower one.
        learned.learn(&l, &announced(6_000.0, 1.0e6, 0), 2_000);
        assert_eq!(learned.lower(&l, 2_000), l);
        // A node's share of a fleet of 3 learns its share of the account's limit.
        let share = l.share(3);
        let mut shared = Learned::default();
        shared.learn(&share, &announced(120.0, 40_000.0, 0), 1_000);
        assert_eq!(shared.lower(&share, 1_000).rpm, Some(40.0));
        // A model with no configured limit learns none.
        let open = Limits { rpm: None, tpm: None, ..l };
        learned.learn(&open, &announced(1.0, 1.0, 0), 3_000);
        assert_eq!((learned.requests, learned.tokens), (None, None));
    }

    #[test]
    fn what_an_answer_found_left_is_less_what_was_sent_after_and_plus_what_refilled() {
        let l = limits(); // 10 requests and 1,666.67 tokens a second
        let mut learned = Learned::default();
        learned.charge(1, 100.0, 0, 10_000);
        learned.charge(2, 50.0, 0, 10_000);
        learned.charge(3, 25.0, 0, 10_000);
        learned.more_requests(1);
        let said = (Some(5.0), Some(1_000.0));
        assert_eq!(learned.left(1, &l, said, 0), (Some(2.0), Some(925.0)), "3 requests and 75 tokens after");
        assert_eq!(learned.left(3, &l, said, 0), (Some(4.0), Some(1_000.0)));
        // An answer read at the end of a long call: what refilled meanwhile counts.
        let (requests, tokens) = learned.left(1, &l, said, 120_000);
        assert_eq!(requests, Some(600.0), "refilled past the burst: the burst");
        assert_eq!(tokens, Some(100_000.0));
        assert_eq!(learned.left(9, &l, said, 0), (None, None), "a call not remembered");
        learned.forget(1);
        assert_eq!(learned.left(1, &l, said, 0), (None, None));
        learned.lapse(10_000);
        assert!(learned.sent.is_empty(), "held past their expiry");
        for id in 0..(MAX_SENT as u64 + 10) {
            learned.charge(id, 1.0, 0, 20_000);
        }
        assert_eq!(learned.sent.len(), MAX_SENT, "bounded");
    }

    #[test]
    fn its_lines_read_back_the_same() {
        let mut learned = Learned::default();
        learned.learn(&limits(), &announced(120.0, 40_000.0, 0), 5);
        learned.charge(7, 12.5, 5, 99);
        let mut text = String::new();
        learned.encode(&mut text);
        let mut back = Learned::default();
        for line in text.lines() {
            back.decode_line(line.as_bytes().split(|&b| b == b' '));
        }
        assert_eq!(back, learned);
    }
}
