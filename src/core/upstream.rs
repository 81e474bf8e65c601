//! The HolySheep request and response as both shells send and read them: the request a
//! flight's attempt makes (body, headers) and the `Response` + `ProviderHints` read back.

use super::cache::Response;
use super::config::Config;
use super::limits::{self, Limits, ProviderHints};
use super::request::for_upstream;
use super::store::CasStore;
use std::borrow::Cow;

/// What an upstream call needs from the client's request.
#[derive(Debug, Clone)]
pub struct Outbound {
    pub body: Vec<u8>,
    pub client_authorization: Option<String>,
    pub model: String,
    pub estimate_tokens: u64,
    /// The client asked for a stream (`stream: true`) ...
    pub stream: bool,
    /// ... with the usage event (`stream_options.include_usage`).
    pub include_usage: bool,
}

pub const USER_AGENT: &str = concat!("holysheep-edge/", env!("CARGO_PKG_VERSION"));

impl Outbound {
    /// The body for an attempt on `model` (rewritten when it is a fallback, and for a
    /// stream to ask for the usage event).
    pub fn body_for(&self, model: &str) -> Cow<'_, [u8]> {
        if model == self.model && !self.stream {
            Cow::Borrowed(&self.body)
        } else {
            Cow::Owned(for_upstream(&self.body, model, self.stream))
        }
    }

    /// Prompt tokens, estimated at four bytes of the request body a token.
    pub fn prompt_estimate(&self) -> u64 {
        (self.body.len() as u64).div_ceil(4)
    }

    /// The regular headers of the call: the configured key (`bearer`, `Bearer <key>`)
    /// wins over the client's own authorization.
    pub fn headers<'a>(&'a self, bearer: Option<&'a str>) -> Vec<(&'static str, &'a str)> {
        let mut headers =
            vec![("content-type", "application/json"), ("accept", "application/json"), ("user-agent", USER_AGENT)];
        if let Some(a) = bearer.or(self.client_authorization.as_deref()) {
            headers.push(("authorization", a));
        }
        headers
    }
}

/// `Bearer <key>` for a non-empty key.
pub fn bearer(key: Option<String>) -> Option<String> {
    key.filter(|k| !k.is_empty()).map(|k| format!("Bearer {k}"))
}

/// HolySheep's answer as the core keeps it, and what it said about its limits.
/// `headers` are the response headers (names lower-case or not).
pub fn response(status: u16, headers: &[(String, String)], body: Vec<u8>) -> (Response, ProviderHints) {
    let header = |n: &str| headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(n)).map(|(_, v)| v.clone());
    let response = Response {
        status,
        content_type: header("content-type").unwrap_or_else(|| "application/json".into()),
        headers: header("retry-after").map(|v| vec![("retry-after".to_owned(), v)]).unwrap_or_default(),
        body,
    };
    (response, ProviderHints::from_headers(status, headers))
}

/// The `x-ratelimit-*` headers of `model`'s bucket as it stands now: none, and neither the
/// clock nor the bucket read, for a model without request or token limits (one configured
/// only with prices, say).
pub fn rate_headers(
    store: &impl CasStore,
    config: &Config,
    model: &str,
    now_ms: impl FnOnce() -> u64,
) -> Vec<(&'static str, String)> {
    let Some((bucket, m)) = config.model(model) else { return Vec::new() };
    let l = Limits::of(m);
    if l.rpm.is_none() && l.tpm.is_none() {
        return Vec::new();
    }
    limits::peek(store, bucket, &l, now_ms()).headers(&l)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::store::Counting;

    fn outbound() -> Outbound {
        Outbound {
            body: br#"{"model":"gpt-4.1","messages":[]}"#.to_vec(),
            client_authorization: Some("Bearer client".into()),
            model: "gpt-4.1".into(),
            estimate_tokens: 10,
            stream: false,
            include_usage: false,
        }
    }

    #[test]
    fn rate_headers_only_for_a_model_with_limits_and_only_then_a_read() {
        let config =
            Config::parse(br#"{"models":{"priced":{"usd_per_mtok_input":2.0},"limited":{"requests_per_minute":60}}}"#)
                .unwrap();
        let store = Counting::new();
        let unread = || -> u64 { panic!("the clock was read") };
        assert!(rate_headers(&store, &config, "priced", unread).is_empty());
        assert!(rate_headers(&store, &config, "unknown", unread).is_empty());
        assert_eq!(store.reads(), 0, "no bucket read without limits");
        let h = rate_headers(&store, &config, "limited", || 1_000);
        assert_eq!(h.iter().find(|(n, _)| *n == "x-ratelimit-limit-requests").map(|(_, v)| v.as_str()), Some("60"));
        assert_eq!(store.reads(), 1);
    }

    #[test]
    fn configured_key_wins_over_the_clients() {
        let o = outbound();
        let auth = |h: Vec<(&str, &str)>| h.iter().find(|(n, _)| *n == "authorization").map(|(_, v)| v.to_string());
        assert_eq!(auth(o.headers(Some("Bearer edge"))).as_deref(), Some("Bearer edge"));
        assert_eq!(auth(o.headers(None)).as_deref(), Some("Bearer client"));
        assert_eq!(bearer(Some(String::new())), None);
    }

    #[test]
    fn a_fallback_attempt_rewrites_only_the_model() {
        let o = outbound();
        assert_eq!(&*o.body_for("gpt-4.1"), o.body.as_slice());
        let v: serde_json::Value = serde_json::from_slice(&o.body_for("deepseek-v3")).unwrap();
        assert_eq!(v["model"], "deepseek-v3");
    }

    #[test]
    fn a_stream_always_asks_for_the_usage_event() {
        let o = Outbound {
            body: br#"{"model":"gpt-4.1","messages":[],"stream":true,"stream_options":{"x":1}}"#.to_vec(),
            stream: true,
            ..outbound()
        };
        let v: serde_json::Value = serde_json::from_slice(&o.body_for("gpt-4.1")).unwrap();
        assert_eq!(
            (v["stream_options"]["include_usage"].as_bool(), v["stream_options"]["x"].as_u64()),
            (Some(true), Some(1))
        );
        assert_eq!(v["stream"], true);
    }

    #[test]
    fn response_keeps_retry_after_and_reads_hints() {
        let headers = vec![
            ("Content-Type".to_owned(), "application/json".to_owned()),
            ("Retry-After".to_owned(), "2".to_owned()),
            ("x-ratelimit-remaining-requests".to_owned(), "7".to_owned()),
        ];
        let (r, hints) = response(429, &headers, b"{}".to_vec());
        assert_eq!(r.header("retry-after"), Some("2"));
        assert!(hints.throttled);
        assert_eq!(hints.retry_after_ms, Some(2000));
        assert_eq!(hints.remaining_requests, Some(7.0));
    }
}
