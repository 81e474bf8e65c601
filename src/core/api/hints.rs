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
    /// The provider answered 429; `retry_after_ms` if it said when to come back.
    pub throttled: bool,
    pub retry_after_ms: Option<u64>,
    /// HolySheep refused the operator's key (401, 403): no other attempt can do better.
    /// Not part of the fleet's settlement message (model owners of other versions
    /// refuse fields they do not know).
    pub key_refused: bool,
    /// What the attempt was billed, read from HolySheep's answer before the edge put an
    /// error of its own in its place. Not part of the settlement message either.
    pub billed: Billed,
}

impl ProviderHints {
    /// As a settlement message writes it (what the provider said of its limits: neither
    /// `key_refused` nor `billed`, which model owners of other versions would refuse).
    pub(crate) fn to_json(self) -> String {
        Object::new()
            .f64("remaining_requests", self.remaining_requests)
            .f64("remaining_tokens", self.remaining_tokens)
            .bool("throttled", self.throttled)
            .opt_u64("retry_after_ms", self.retry_after_ms)
            .finish()
    }

    pub(crate) fn read(json: Json<'_>) -> Option<ProviderHints> {
        let names = ["remaining_requests", "remaining_tokens", "throttled", "retry_after_ms"];
        let [requests, tokens, throttled, retry_after_ms] = json.fields(names)?;
        Some(ProviderHints {
            remaining_requests: scan::opt(requests, Json::as_f64)?,
            remaining_tokens: scan::opt(tokens, Json::as_f64)?,
            throttled: throttled?.as_bool()?,
            retry_after_ms: scan::opt(retry_after_ms, Json::as_u64)?,
            key_refused: false,
            billed: Billed::Unknown,
        })
    }

    pub fn from_headers(status: u16, headers: &[(String, String)]) -> ProviderHints {
        let get = |n: &str| headers::value(headers, n).map(str::trim);
        ProviderHints {
            remaining_requests: get(headers::REMAINING_REQUESTS).and_then(float::parse),
            remaining_tokens: get(headers::REMAINING_TOKENS).and_then(float::parse),
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
}
