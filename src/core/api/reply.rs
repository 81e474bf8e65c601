//! An answer as the client gets it: its cache status (`CacheStatus`), the reply the core
//! hands a shell whole (`Reply`: the response and what its headers say of the cache), and
//! the edge's own headers on a streamed answer (`stream_head`).

use crate::core::api::error::ApiError;
use crate::core::api::headers;
use crate::core::api::key::Key;
use crate::core::api::response::Response;
use std::borrow::Cow;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CacheStatus {
    Hit,
    Miss,
    Coalesced,
    Bypass,
    /// An expired entry served because every attempt failed (`stale_if_error_seconds`).
    Stale,
    /// The fresh answer of a paraphrase, from the semantic tier.
    Semantic,
}

impl CacheStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheStatus::Hit => "HIT",
            CacheStatus::Miss => "MISS",
            CacheStatus::Coalesced => "COALESCED",
            CacheStatus::Bypass => "BYPASS",
            CacheStatus::Stale => "STALE",
            CacheStatus::Semantic => "SEMANTIC",
        }
    }
}

/// A response for the client, with everything needed to render its headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub response: Response,
    pub cache: Option<CacheStatus>,
    pub key: Option<Key>,
    pub age_s: Option<u64>,
    /// Seconds the answer stays fresh in the cache that served or stored it (`None`: it is
    /// in none), which its `cache-control` declares.
    pub fresh_s: Option<u64>,
}

impl Reply {
    /// Whether this is the reply of a waiter that could not read its flight's outcome.
    pub(crate) fn lost_wait(&self) -> bool {
        self.response.status == 503 && self.response.header(headers::WAIT) == Some("lost")
    }

    /// Whether this is an answer now stored in the cache (a fresh 200).
    pub fn stored_answer(&self) -> bool {
        self.fresh_s.is_some() && self.response.status == 200
    }

    pub fn error(e: &ApiError) -> Reply {
        Reply::plain(error_response(e))
    }

    /// A response that is no answer to a chat request (no cache status, no key).
    pub fn plain(response: Response) -> Reply {
        Reply { response, cache: None, key: None, age_s: None, fresh_s: None }
    }

    /// The reply's headers; only `age` and `cache-control` are built, the others are
    /// borrowed. An answer to a chat request (one with a cache status) says how long it
    /// stays fresh (see `directive`).
    pub fn headers(&self) -> Vec<(&str, Cow<'_, str>)> {
        let mut h = Vec::with_capacity(5 + self.response.headers.len());
        h.push((headers::CONTENT_TYPE, Cow::Borrowed(self.response.content_type.as_str())));
        if let Some(c) = self.cache {
            h.push((headers::CACHE, Cow::Borrowed(c.as_str())));
            h.push((headers::CACHE_CONTROL, directive(self.fresh_s)));
        }
        if let Some(k) = &self.key {
            h.push((headers::KEY, Cow::Borrowed(k.hex())));
        }
        if let Some(a) = self.age_s {
            h.push((headers::AGE, Cow::Owned(a.to_string())));
        }
        h.extend(self.response.headers.iter().map(|(n, v)| (n.as_str(), Cow::Borrowed(v.as_str()))));
        h
    }
}

/// The edge's own headers on a streamed answer, the same in both shells: its cache
/// status, its key, the model that answered, the verified tenant, and how long the
/// answer is kept (`fresh_s`, see `directive`).
pub fn stream_head(
    cache: CacheStatus,
    key: &str,
    model: &str,
    tenant: Option<&str>,
    fresh_s: Option<u64>,
) -> Vec<(&'static str, String)> {
    let mut h = vec![
        (headers::CACHE, cache.as_str().to_owned()),
        (headers::KEY, key.to_owned()),
        (headers::MODEL, model.to_owned()),
        (headers::CACHE_CONTROL, directive(fresh_s).into_owned()),
    ];
    h.extend(tenant.map(|t| (headers::TENANT, t.to_owned())));
    h
}

/// The `cache-control` an answer carries: fresh for `fresh_s` more seconds in the cache
/// that served or stored it, or `no-store` when it is in none.
pub fn directive(fresh_s: Option<u64>) -> Cow<'static, str> {
    match fresh_s {
        Some(s) => Cow::Owned(format!("max-age={s}")),
        None => Cow::Borrowed("no-store"),
    }
}

/// An OpenAI-shaped error as a response.
pub(crate) fn error_response(e: &ApiError) -> Response {
    Response::json(e.status, e.body())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_says_how_long_it_stays_fresh_or_that_it_is_kept_nowhere() {
        assert_eq!((directive(Some(42)), directive(None)), ("max-age=42".into(), "no-store".into()));
    }

    #[test]
    fn a_streamed_answers_head_is_the_edges_own() {
        let h = stream_head(CacheStatus::Miss, "abc", "gpt-4.1", Some("alpha"), Some(60));
        let h: Vec<(&str, &str)> = h.iter().map(|(n, v)| (*n, v.as_str())).collect();
        assert_eq!(
            h,
            [
                ("x-holysheep-cache", "MISS"),
                ("x-holysheep-key", "abc"),
                ("x-holysheep-model", "gpt-4.1"),
                ("cache-control", "max-age=60"),
                ("x-holysheep-tenant", "alpha"),
            ]
        );
        let unstored = stream_head(CacheStatus::Bypass, "abc", "m", None, None);
        assert_eq!(unstored.len(), 4);
        assert_eq!(unstored[3], ("cache-control", "no-store".to_owned()));
    }
}
