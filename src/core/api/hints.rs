//! What HolySheep's answer says beyond the body the client gets: its own limits (the
//! remaining requests and tokens, a 429 and when to come back), whether it refused the
//! operator's key, and what the attempt was billed.

use super::headers;
use crate::core::api::usage::Billed;
use crate::core::wire::float;
use crate::core::wire::scan::{self, Json};
use crate::core::wire::write::Object;

/// What the provider said about its own limits.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ProviderHints {
    pub remaining_requests: Option<f64>,
    pub remaining_tokens: Option<f64>,
    /// Its own limits per minute (`x-ratelimit-limit-*`: part of the fleet's settlement
    /// message, so that a model's owner learns them for the whole fleet), and when each is
    /// whole again (`x-ratelimit-reset-*`, in milliseconds from the answer).
    pub limit_requests: Option<f64>,
    pub limit_tokens: Option<f64>,
    pub reset_requests_ms: Option<u64>,
    pub reset_tokens_ms: Option<u64>,
    /// `x-ratelimit-*` headers present but not believable (not a number, negative, absurd,
    /// a remainder above the limit, a reset in the past or days away): each ignored.
    pub ignored: u8,
    /// The provider answered 429; `retry_after_ms` if it said when to come back.
    pub throttled: bool,
    pub retry_after_ms: Option<u64>,
    /// HolySheep refused the operator's key (401, 403): no other attempt can do better.
    /// Not part of the fleet's settlement message (it is the attempt's, not the bucket's).
    pub key_refused: bool,
    /// What the attempt was billed, read from HolySheep's answer before the edge put an
    /// error of its own in its place. Not part of the settlement message either.
    pub billed: Billed,
}

impl ProviderHints {
    /// As a settlement message writes it: what the provider said of its limits (neither
    /// `key_refused` nor `billed`, which are the attempt's). The limits are left out when
    /// it named none; a model owner of an earlier release skips them (hints are read as
    /// serde reads a struct, other members skipped).
    pub(crate) fn to_json(self) -> String {
        let mut o = Object::new()
            .f64("remaining_requests", self.remaining_requests)
            .f64("remaining_tokens", self.remaining_tokens)
            .bool("throttled", self.throttled)
            .opt_u64("retry_after_ms", self.retry_after_ms);
        for (name, limit) in [("limit_requests", self.limit_requests), ("limit_tokens", self.limit_tokens)] {
            if limit.is_some() {
                o = o.f64(name, limit);
            }
        }
        o.finish()
    }

    /// A settlement's hints (`to_json`). A limit is believed as from HolySheep's headers
    /// (`from_headers`), a count of at least 1 within the bound; another is left out, and
    /// the settlement still read (it carries what the call cost).
    pub(crate) fn read(json: Json<'_>) -> Option<ProviderHints> {
        let names =
            ["remaining_requests", "remaining_tokens", "throttled", "retry_after_ms", "limit_requests", "limit_tokens"];
        let [requests, tokens, throttled, retry_after_ms, limit_requests, limit_tokens] = json.fields(names)?;
        // A limit is believed or left out: never a reason to lose the settlement.
        let limit = |v: Option<Json<'_>>, most: f64| v.and_then(|j| j.as_f64()).filter(|l| (1.0..=most).contains(l));
        Some(ProviderHints {
            remaining_requests: scan::opt(requests, Json::as_f64)?,
            remaining_tokens: scan::opt(tokens, Json::as_f64)?,
            throttled: throttled?.as_bool()?,
            retry_after_ms: scan::opt(retry_after_ms, Json::as_u64)?,
            limit_requests: limit(limit_requests, MAX_REQUESTS),
            limit_tokens: limit(limit_tokens, MAX_TOKENS),
            ..ProviderHints::default()
        })
    }

    /// From HolySheep's answer (`status`, `headers`). Every `x-ratelimit-*` header is
    /// checked before it is believed: see `ignored`.
    pub fn from_headers(status: u16, headers: &[(String, String)]) -> ProviderHints {
        let get = |n: &str| headers::value(headers, n).map(str::trim);
        let mut ignored = 0u8;
        let mut read = |name: &str, parse: &dyn Fn(&str) -> Option<f64>| {
            let value = get(name)?;
            let read = parse(value);
            ignored = ignored.saturating_add(u8::from(read.is_none()));
            read
        };
        let limit_requests = read(headers::LIMIT_REQUESTS, &|v| count(v, MAX_REQUESTS).filter(|l| *l >= 1.0));
        let limit_tokens = read(headers::LIMIT_TOKENS, &|v| count(v, MAX_TOKENS).filter(|l| *l >= 1.0));
        let below = |limit: Option<f64>, max: f64| move |v: &str| count(v, limit.unwrap_or(max));
        let remaining_requests = read(headers::REMAINING_REQUESTS, &below(limit_requests, MAX_REQUESTS));
        let remaining_tokens = read(headers::REMAINING_TOKENS, &below(limit_tokens, MAX_TOKENS));
        let reset = |v: &str| reset_ms(v).map(|ms| ms as f64);
        let reset_requests_ms = read(headers::RESET_REQUESTS, &reset).map(|ms| ms as u64);
        let reset_tokens_ms = read(headers::RESET_TOKENS, &reset).map(|ms| ms as u64);
        ProviderHints {
            remaining_requests,
            remaining_tokens,
            limit_requests,
            limit_tokens,
            reset_requests_ms,
            reset_tokens_ms,
            ignored,
            throttled: status == 429,
            retry_after_ms: retry_after_ms(get("retry-after-ms"), get(headers::RETRY_AFTER)),
            key_refused: false,
            billed: Billed::Unknown,
        }
    }

    /// The hints of an attempt that never reached HolySheep (refused at dispatch, its
    /// connection never made): it was billed nothing.
    pub fn unsent() -> ProviderHints {
        ProviderHints { billed: Billed::Unsent, ..ProviderHints::default() }
    }
}

/// The most requests, and tokens, a minute a header is believed to announce.
const MAX_REQUESTS: f64 = 1.0e9;
const MAX_TOKENS: f64 = 1.0e12;
/// The furthest reset believed: a day.
const MAX_RESET_MS: f64 = 86_400_000.0;

/// A count between 0 and `max`.
fn count(text: &str, max: f64) -> Option<f64> {
    float::parse(text).filter(|v| v.is_finite() && (0.0..=max).contains(v))
}

/// When a limit is whole again, in milliseconds from the answer: OpenAI's duration
/// (`20ms`, `1.5s`, `6m0s`, `1h2m3s`) or plain seconds. `None` for a negative span or one
/// beyond a day (a time since the epoch among them).
pub(crate) fn reset_ms(text: &str) -> Option<u64> {
    let ms = match float::parse(text) {
        Some(secs) => secs * 1000.0,
        None => span_ms(text)?,
    };
    (ms.is_finite() && (0.0..=MAX_RESET_MS).contains(&ms)).then(|| ms.ceil() as u64)
}

/// `1h2m3.5s`, `250ms`: numbers each followed by `h`, `m`, `s` or `ms`.
fn span_ms(text: &str) -> Option<f64> {
    let (mut total, mut rest) = (0.0, text);
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).filter(|n| *n > 0)?;
        let value = float::parse(&rest[..digits])?;
        rest = &rest[digits..];
        let (unit, len) = match () {
            _ if rest.starts_with("ms") => (1.0, 2),
            _ if rest.starts_with('h') => (3_600_000.0, 1),
            _ if rest.starts_with('m') => (60_000.0, 1),
            _ if rest.starts_with('s') => (1_000.0, 1),
            _ => return None,
        };
        total += value * unit;
        rest = &rest[len..];
    }
    Some(total)
}

/// `retry-after-ms`, else `retry-after` in seconds (HTTP dates are not honoured).
pub(crate) fn retry_after_ms(ms: Option<&str>, secs: Option<&str>) -> Option<u64> {
    ms.and_then(float::parse)
        .or_else(|| secs.and_then(float::parse).map(|s| s * 1000.0))
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map(|v| v.ceil() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_from_headers() {
        let h = vec![
            ("retry-after".to_owned(), "2".to_owned()),
            ("x-ratelimit-remaining-tokens".to_owned(), "50".to_owned()),
        ];
        let p = ProviderHints::from_headers(429, &h);
        assert_eq!((p.throttled, p.retry_after_ms, p.remaining_tokens), (true, Some(2000), Some(50.0)));
        assert_eq!(retry_after_ms(Some("1500"), Some("9")), Some(1500));
    }

    fn hints(pairs: &[(&str, &str)]) -> ProviderHints {
        let h: Vec<(String, String)> = pairs.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
        ProviderHints::from_headers(200, &h)
    }

    #[test]
    fn openais_limit_headers_are_read() {
        let p = hints(&[
            ("x-ratelimit-limit-requests", "120"),
            ("x-ratelimit-remaining-requests", "7"),
            ("x-ratelimit-reset-requests", "6m0s"),
            ("x-ratelimit-limit-tokens", "40000"),
            ("x-ratelimit-remaining-tokens", "39000.5"),
            ("x-ratelimit-reset-tokens", "1.5s"),
        ]);
        assert_eq!(
            (p.limit_requests, p.remaining_requests, p.reset_requests_ms),
            (Some(120.0), Some(7.0), Some(360_000))
        );
        assert_eq!(
            (p.limit_tokens, p.remaining_tokens, p.reset_tokens_ms),
            (Some(40_000.0), Some(39_000.5), Some(1_500))
        );
        assert_eq!(p.ignored, 0);
        for (text, ms) in [("20ms", 20), ("1h2m3s", 3_723_000), ("0s", 0), ("2", 2_000), ("0.25", 250)] {
            assert_eq!(reset_ms(text), Some(ms), "{text}");
        }
    }

    #[test]
    fn unbelievable_limit_headers_are_ignored_and_counted() {
        for (name, value) in [
            ("x-ratelimit-limit-requests", "-5"),
            ("x-ratelimit-limit-requests", "0"),
            ("x-ratelimit-limit-requests", "1e12"),
            ("x-ratelimit-limit-requests", "lots"),
            ("x-ratelimit-limit-tokens", "NaN"),
            ("x-ratelimit-remaining-requests", "-1"),
            ("x-ratelimit-remaining-tokens", "inf"),
            ("x-ratelimit-reset-requests", "-3s"),
            ("x-ratelimit-reset-requests", "1800000000"),
            ("x-ratelimit-reset-tokens", "3d"),
            ("x-ratelimit-reset-tokens", "5 s"),
            ("x-ratelimit-reset-tokens", ""),
        ] {
            let p = hints(&[(name, value)]);
            assert_eq!(p.ignored, 1, "{name}: {value}");
            let read = [p.limit_requests, p.limit_tokens, p.remaining_requests, p.remaining_tokens];
            assert!(read.iter().all(Option::is_none), "{name}: {value}");
            assert_eq!((p.reset_requests_ms, p.reset_tokens_ms), (None, None), "{name}: {value}");
        }
        // A remainder above the limit announced beside it is not believed; the limit is.
        let p = hints(&[("x-ratelimit-limit-requests", "10"), ("x-ratelimit-remaining-requests", "11")]);
        assert_eq!((p.limit_requests, p.remaining_requests, p.ignored), (Some(10.0), None, 1));
    }
}
